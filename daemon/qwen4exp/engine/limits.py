"""The engine's limits that the settings, the engine and the estimate share (no torch, no imports: any module reads
them without a cycle)."""

# A decode step runs every slot as a row; up to row_products.MAX_ROWS rows its dense products stay on the row
# kernel, which reads each weight once at memory bandwidth (more rows would go to F.linear). The profile schema
# says the same number (config/schema.py; tests/test_config.py holds them together).
MAX_SLOTS = 16
MAX_DRAFTS = 7        # most drafted tokens per slot and step (speculative.py)
# What `mtp = "auto"` drafts where a step's positions verify together off a CPU (a GPU): none until drafting measures
# faster than plain decoding on the full model at a trained head's acceptance, with plain decoding's answers, at one
# slot and several. One slot pays on the 48 layers; four slots give plain decoding's answers on the first 24, while on
# all 48 an earlier build's did not and the check is not yet repeated (docs/PERFORMANCE.md, the MTP section). A
# number in the profile drafts anyway.
AUTO_DRAFTS = 0
