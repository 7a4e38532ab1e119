"""Training data: corpora, token files and per-process batches, and the step that
prepares a token file with a tokenizer.
"""
