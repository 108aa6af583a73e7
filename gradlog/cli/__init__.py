"""The command line: `gradlog demo`, `gradlog report`. `entry.main` is the console script."""
