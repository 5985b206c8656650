"""What keeps a run safe around its training: lock (one run per output_dir), preflight (the multi-node checks
before any model), resume (a checkpoint taken by this setup, or what changed), failures (what a rank says when it
or a peer fails) and launcher (starting a process with a hard limit, for the tests and bench/)."""
