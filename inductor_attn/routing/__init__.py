"""The graph-rewrite pass behind enable(): SDPA and flex_attention calls become inductor_attn ops."""
