"""The webhook sender: its process, the sending loop, the signed POST and its metrics."""
