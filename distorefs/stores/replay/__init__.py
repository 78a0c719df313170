"""Replay buffers and memory banks: plain Python + numpy, no FUSE."""
