"""How ZeRO buckets cross the wire: `plain` (reduce-scatter / all-gather) or `sdp4bit` (qWD weight
differences, TLq-HS two-level quantized gradients); `codecs` holds SDP4Bit's quantizer and Hadamard."""
