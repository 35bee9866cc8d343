"""The checkpoint format shared by training and its readers (no torch.distributed state)."""
