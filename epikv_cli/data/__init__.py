"""Prompts, datasets and JSONL results files."""
