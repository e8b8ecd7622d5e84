"""Reading, validating, tokenizing and splitting the input data."""
