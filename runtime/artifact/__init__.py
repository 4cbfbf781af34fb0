"""What an artifact directory is: its manifest, its files' hashes, replacing it in place,
paths confined to it, and the embedding table read from it."""
