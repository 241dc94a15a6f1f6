"""`python -m paratrain.checkpoint.writer`: a rank's checkpoint writer process (paratrain.checkpoint.async_save),
in a module of its own that nothing imports (running async_save itself as __main__ would load it twice)."""

from paratrain.checkpoint.async_save import main

if __name__ == "__main__":
    main()
