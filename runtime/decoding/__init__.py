"""What turns a step's logits into text: sampling, the JSON schema's token mask, incremental
detokenizing, and when a row copying its prompt runs deeper (deep copies)."""
