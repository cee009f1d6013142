"""What a process keeps between runs and reads of its machine: the on-disk cache folders (`disk`), compiled executables
serialized there (`executables`), and the CPU's instruction sets (`cpu`)."""
