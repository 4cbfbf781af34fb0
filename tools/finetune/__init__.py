"""SkipDecode fine-tuning: ``python -m tools.finetune``.

Trains an OPT checkpoint with the SkipDecode policy applied exactly as the runtime decodes: the
prompt at full depth, generated position ``g`` (whose input is the g-th target token) through
``policy.active_layers(g)``, skipped layers passing the hidden state on unchanged. The whole
sequence is computed in one parallel pass; a per-(row, position, layer) mask keeps a skipped
layer's output from reaching the residual stream. Because the active sets only shrink along the
sequence, every position that runs a layer attends only to earlier positions that ran it too, so
the masked parallel pass equals step-by-step decoding (tests/tools/test_finetune.py checks it).
"""
