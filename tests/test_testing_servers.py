"""The free ports the test servers and clusters listen on."""

import socket

from de_store.testing.servers import free_ports


def ephemeral_range() -> tuple[int, int]:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(part) for part in f.read().split())
    return low, high


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    # a port the kernel may hand to any outgoing connection can be taken between the
    # pick and the server's bind; a TF server then fails with "Could not start gRPC server"
    low, _ = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 <= port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_picked():
    taken = [socket.socket() for _ in range(200)]
    try:
        in_use = set()
        for sock, port in zip(taken, free_ports(200), strict=True):
            sock.bind(("0.0.0.0", port))
            in_use.add(port)
        # every port of the next draws is one nobody listens on
        for _ in range(5):
            assert not in_use & set(free_ports(50))
    finally:
        for sock in taken:
            sock.close()
