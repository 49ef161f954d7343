"""Operating the server: start tritonserver on loopback (launcher) and stream from it (client)."""
