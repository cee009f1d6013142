"""What a process keeps between runs and reads of its machine: the on-disk cache folders (`disk`), compiled executables
serialized there (`executables`), the CPU's instruction sets (`cpu`), and, on request, the memory it frees between
calls (`memory`)."""
