"""What the machine offers a backend: huge pages, whether other processes use its cores, and
the int4/int8 kernel built for its CPU."""
