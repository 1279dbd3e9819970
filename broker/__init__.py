"""Everything that touches Redis: keys, messages, admission, consumption, replies, registries."""
