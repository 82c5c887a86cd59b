"""The Hugging Face Hub: files asked for once, objects saved as one JSON file, masks published with their model card."""
