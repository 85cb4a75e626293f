"""Join events into requests, and requests to the GPU work they caused."""
