"""The engine's limits that the settings, the engine and the estimate share (no torch, no imports: any module reads
them without a cycle)."""

# A decode step runs every slot as a row; up to row_products.MAX_ROWS rows its dense products stay on the row
# kernel, which reads each weight once at memory bandwidth (more rows would go to F.linear). The profile schema
# says the same number (config/schema.py; tests/test_config.py holds them together).
MAX_SLOTS = 16
MAX_DRAFTS = 7        # most drafted tokens per slot and step (speculative.py)
AUTO_DRAFTS = 3       # what mtp = "auto" drafts where drafting pays
