"""Transfer backends: the Mooncake and Ascend KV managers, importing the transfer engine, and where
registered memory lives (which engine build can register it)."""
