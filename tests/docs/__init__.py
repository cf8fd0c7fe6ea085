"""The docs: every code block of README.md and docs/*.md run or dry-run, and their links checked."""
