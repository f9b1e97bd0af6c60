"""linreg: a user template in its smallest real shape (templates/README.md, "Writing your own")."""
