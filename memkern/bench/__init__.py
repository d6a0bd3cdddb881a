"""The embedded default of ``memkern bench``: a small GPT trained character-level on the
Python standard library's own source files, under several training configurations."""
