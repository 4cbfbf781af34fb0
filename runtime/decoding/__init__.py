"""What turns a step's logits into text: sampling, the JSON schema's token mask, and incremental
detokenizing."""
