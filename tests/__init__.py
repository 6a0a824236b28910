"""shardwise tests.

A package (``tests.test_x``) so that rank processes started by
``tests._dist.run_ranks`` can import the module that defines a test body.
"""
