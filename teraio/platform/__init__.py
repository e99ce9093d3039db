"""Process-level fixes and checks: the C library's malloc policy, MKL VML's first-call dispatch, and the
preflight checks of the directories an option names."""
