"""The KV relay: an engine's KV-cache events, read in its allocation, served as block digests."""
