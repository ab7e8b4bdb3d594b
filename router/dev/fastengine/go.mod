module pdinference.dev/fastengine

go 1.22
