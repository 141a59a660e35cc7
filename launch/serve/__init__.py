"""`kiln serve`: Kiln's verifier as an HTTP service any trainer can call (docs/verifier.md, "The
verifier service")."""
