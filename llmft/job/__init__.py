"""The process in its job: ranks and collectives, the stall watchdog, the host allocator, the GPU it sees."""
