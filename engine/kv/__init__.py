"""The KV pool (one K and one V buffer per layer, allocated once) and the staging and landing
buffers of head-sliced transfers."""
