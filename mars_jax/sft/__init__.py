"""Warm start for toy MarsRL: generated role traces (`traces`) and supervised fine-tuning (`train`)."""
