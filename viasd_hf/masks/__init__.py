"""Routing masks: which decoder layers the slim verifier keeps, mask sets, layer skipping, supported architectures, where a pair's mask is found."""
