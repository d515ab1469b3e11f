"""The DRA front-end: the node's devices as ResourceSlices, claims prepared through the kubelet's DRA API.

A node is served by this front-end or by the device plugins (`sharing.deviceplugin`), never both.
"""
