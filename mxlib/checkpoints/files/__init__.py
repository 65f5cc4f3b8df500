"""A checkpoint's files: read as untrusted input, written atomically.

==================  ===========================================================================================
module              what it holds
==================  ===========================================================================================
``untrusted``       files of a checkpoint or config folder read with the standard library only (regular files
                    only, bounded reads, checked config fields), so that the command line checks them before
                    anything heavy is imported
``headers``         the checked index and safetensors headers, one reader for the loader and the inspector
``folder``          ``CheckpointFolder``: a checkpoint folder whose JSON config files are each read once per
                    load, handed to every step of the loader, the inspector and the writers that read a folder
``safetensors_io``  safetensors shards written (``ShardWriter``) and read (``TensorReader``)
``atomic_write``    the atomic folder write every checkpoint writer goes through (``atomic_folder``) and its
                    crash points
==================  ===========================================================================================

Importing this package imports none of its modules.
"""
