//! GPU↔GPU peer-to-peer: topology, peer access, peer copies that report their path.
