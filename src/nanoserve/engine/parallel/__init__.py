"""Running the model on one rank or on every rank of a tensor-parallel group: the executor the
engine calls, the rank 0 side that sends each call to the workers, the workers, and the message
channel between them."""
