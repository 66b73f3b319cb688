"""Sessions: a conversation's record in a store (Redis, or memory for the CLI), owned by
one generation at a time, and the runner that drives generations on them."""
