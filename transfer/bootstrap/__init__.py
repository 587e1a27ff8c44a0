"""The P/D handshake ("bootstrap"): its shared configuration and compatibility check
(``handshake``), the decode side (``decode``), the prefill side (``prefill``), every message that
crosses the boundary (``messages``) and their framing on a socket (``wire``)."""
