"""The wire protocol: the ``.proto`` files and their generated modules (``pdserve/v1/``), the
script that regenerates them (``generate.sh``) and message <-> plain value conversion
(:mod:`proto.convert`)."""
