"""Replies: the worker's writer of token deltas and finals, the api's router of reply streams with
its shared reads (shards), reading a stream as events, and the wake-up of long polls."""
