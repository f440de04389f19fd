"""HTTP plumbing the routes share: bodies under a size cap, disconnects, event streams, error shapes, and the gate
with its browser checks (Host, content type, origin) and CORS."""
