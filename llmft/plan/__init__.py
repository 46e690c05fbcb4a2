"""Planning: pure arithmetic and config compilers. Imports no torch and no deepspeed."""
