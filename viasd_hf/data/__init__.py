"""The evaluation data shipped with viasd_hf (see README.md here), and one loader per dataset."""
