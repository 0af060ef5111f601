"""Datasets built from local files: prompts, SFT conversations, preference pairs, mixing."""
