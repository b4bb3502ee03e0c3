# The native block copier (`_blockcopy.c`); `kvd_client.backends.native` wraps it.
def copy_blocks(
    num_blocks: int,
    num_layers: int,
    dst_ids: int,
    src_ids: int,
    dst_base: int,
    dst_stride: int,
    src_base: int,
    src_stride: int,
    sizes: int,
    streaming: bool,
    threads: int,
    /,
) -> None: ...
def streaming_kind() -> str: ...
