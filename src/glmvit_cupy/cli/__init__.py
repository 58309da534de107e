"""glmvit-encode: files, folders and globs -> embeddings in safetensors shards and a manifest.

    main      the command: arguments, the images' pipeline, the summary
    common    exit statuses, stdout and stderr, the lines that report a skipped input, the vLLM files it writes
    inputs    inputs expanded into files; images read, hashed and prepared on threads
    videos    video files: read on threads, encoded on a free GPU lane, written as they finish
"""
