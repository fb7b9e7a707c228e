"""How bytes move: the Transport contract, the pool seen as bytes, and one folder per transport."""
