"""End to end: `cadence serve` and `cadence router` as real processes spoken to over HTTP,
the client SDK and load generator against them, and the deploy/ files."""
