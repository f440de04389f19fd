"""HTTP plumbing the routes share: bodies under a size cap, disconnects, event streams, the gate, error shapes."""
