"""viasd bench: every decoding method on the same prompts, speed and quality side by side."""
