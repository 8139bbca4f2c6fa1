"""How people reach veosnap: the `veosnap` command and the pytest plugin (on syrupy). Thin skins over
`runs` and `render`: they parse what the user asked, call the same functions, and print or assert."""
